"""The generation layer: settings and results, the seeded sampler and its logits processors, the one
decode loop (decode.py: Sequence, Event, decode, decode_steps) that greedy, sampled and speculative
generation run on, token logprobs, and beam search. Runs on any gpt2x.runtime.base.Backend."""
