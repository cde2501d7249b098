"""`gpt2x serve` on Ray Serve (replicas, a cluster, or --ray): the deployment and its hub (deploy.py).
The only part of gpt2x that imports Ray."""
