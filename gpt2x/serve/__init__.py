"""`gpt2x serve`: the core (core/: scheduler, runner, engine), the OpenAI API over it (openai/), and the
two ways to run a replica: in this process without Ray (single_process.py, the default) and on Ray
Serve (ray/); replica.py is what both share."""
