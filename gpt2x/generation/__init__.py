"""The generation layer: settings and results, the seeded sampler, the shared decode loop with greedy
and sampled generation, and beam search. Runs on any gpt2x.runtime.base.Backend."""
