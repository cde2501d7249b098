"""`gpt2x generate`: text from a prompt (streamed) or from a file of prompts (one left-padded batch)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from ..choices import BackendKind, KvCache, ProviderKind
from ..errors import UsageError
from ..generation.constraints import ConstraintSpec
from ..generation.generate import generate as run_generation
from ..generation.generate import most_step_tokens
from ..generation.settings import SamplingSettings
from ..generation.speculative import DraftSettings
from ..runtime.registry import refuse_export_folder
from ..tokenizer import StreamDecoder, decode, load_in_background
from ..workflows.backends import choose_backend, open_backend
from ..workflows.drafts import DRAFT_HELP, check_draft, open_drafter
from .options import (
    BACKEND_DEFAULT,
    BEAM_PANEL,
    DRAFT_PANEL,
    RUNTIME_PANEL,
    SAMPLING_PANEL,
    STRUCTURED_PANEL,
    ExportsOpt,
    JsonOpt,
    KvCacheOpt,
    KvDtypeOpt,
    ModelOptional,
    NumSpeculativeTokensOpt,
    PrecisionOpt,
    PrefillOpt,
    RevisionOpt,
    Status,
    ThreadsOpt,
    err,
    notice,
    parse_logit_bias,
    parse_token_ids,
    progress_to,
    read_prompts_file,
    read_text_file,
    refuse_int8_kv,
    refuse_kv_cache,
)

EPILOG = ("Examples:\n\n"
    "  gpt2x generate \"ROMEO:\" --model shakespeare --backend torch --seed 1\n\n"
    "  gpt2x generate \"ROMEO:\" --seed 1 --temperature 0.8 --top-p 0.9 --top-k 40    (defaults: 1, 1, off, as OpenAI's API)\n\n"
    "  gpt2x generate \"Hello, my name is\" --model gpt2 --temperature 0 --max-new-tokens 20    (0: greedy, as --greedy)\n\n"
    "  gpt2x generate --prompts-file prompts.txt --model shakespeare --backend torch --json\n\n"
    "  gpt2x generate \"ROMEO:\" --greedy --draft int4 --num-speculative-tokens 8\n\n"
    "  gpt2x generate \"ROMEO:\" --seed 1 --repetition-penalty 1.3 --min-p 0.05 --n 3    (3 samples: seeds 1, 2, 3)\n\n"
    "  gpt2x generate \"ROMEO:\" --greedy --presence-penalty 0.5 --logit-bias 198=-100 --stop-token-ids 13 --min-tokens 8")


def constraint_from(json_schema: Path | None, regex: str | None, choice: list[str] | None,
                    grammar: Path | None) -> ConstraintSpec | None:
    """The structured-output constraint the options ask for (at most one), its files read."""
    given = [name for name, value in (("--json-schema", json_schema), ("--regex", regex), ("--choice", choice),
                                      ("--grammar", grammar)) if value]
    if len(given) > 1:
        raise UsageError(f"give one structured-output option, not {' and '.join(given)}")
    if json_schema is not None:
        return ConstraintSpec.json_schema(read_text_file(json_schema, "JSON schema file"))
    if regex is not None:
        return ConstraintSpec.regex(regex)
    if choice:
        return ConstraintSpec.choice(choice)
    if grammar is not None:
        return ConstraintSpec.grammar(read_text_file(grammar, "grammar file"))
    return None


def dry_breakers(given: list[str] | None) -> tuple[str, ...]:
    """--dry-sequence-breaker as llama.cpp reads it: the default without one, else the ones given; `none` clears."""
    if not given:
        return SamplingSettings.dry_sequence_breakers
    breakers: list[str] = []
    for b in given:
        breakers = [] if b == "none" else [*breakers, b]
    return tuple(breakers)


def before_parsing() -> None:
    """What the command starts before Typer parses its options (`register` calls it): the tokenizer, on a thread, for
    most_step_tokens to read the prompts' lengths before the backend opens."""
    load_in_background()


def generate(
    prompt: Annotated[Optional[str], typer.Argument(help="Text to continue (empty: start a new document).")] = None,
    model: ModelOptional = None,
    revision: RevisionOpt = None,
    exports: ExportsOpt = None,
    prefill: PrefillOpt = None,
    kv_cache_dtype: KvDtypeOpt = None,
    backend: Annotated[Optional[BackendKind], typer.Option(
        help="ort: ONNX Runtime (exports on first use); openvino, genai: OpenVINO or onnxruntime-genai on the same export; "
        f"web: onnxruntime-web (WebAssembly) on the same export in headless Chromium; torch: the PyTorch reference ({BACKEND_DEFAULT}).",
        show_default=False)] = None,
    provider: Annotated[ProviderKind, typer.Option(rich_help_panel=RUNTIME_PANEL, help="Device for the backend.")] = ProviderKind.cpu,
    precision: PrecisionOpt = None,
    onnx_dir: Annotated[Optional[Path], typer.Option("--onnx", rich_help_panel=RUNTIME_PANEL,
        help="Export folder to run (default: EXPORTS/MODEL-PRECISION, see --exports).")] = None,
    threads: ThreadsOpt = None,
    max_new_tokens: Annotated[int, typer.Option(
        help="Tokens to generate (stops earlier at <|endoftext|> or the context limit).")] = SamplingSettings.max_new_tokens,
    greedy: Annotated[bool, typer.Option("--greedy", help="Always take the most likely token (as --temperature 0).")] = False,
    temperature: Annotated[float, typer.Option(help="Sampling temperature (>= 0; 0: greedy).")] = SamplingSettings.temperature,
    top_k: Annotated[int, typer.Option(help="Sample among the k most likely tokens (0: all).")] = SamplingSettings.top_k,
    top_p: Annotated[float, typer.Option(help="Nucleus sampling threshold in (0, 1].")] = SamplingSettings.top_p,
    seed: Annotated[Optional[int], typer.Option(help="Sampler seed: same seed, same text. Random if unset.")] = None,
    min_p: Annotated[float, typer.Option(
        rich_help_panel=SAMPLING_PANEL, help="Drop tokens less likely than MIN_P times the most likely one, in [0, 1] (0: off; vLLM's and "
        "transformers' min_p).")] = SamplingSettings.min_p,
    typical_p: Annotated[float, typer.Option(rich_help_panel=SAMPLING_PANEL,
        help="Locally typical sampling: the tokens whose surprise is nearest the entropy, up to this mass, in (0, 1] "
        "(1: off; transformers' and llama.cpp's typical_p; sampling only).")] = SamplingSettings.typical_p,
    no_repeat_ngram_size: Annotated[int, typer.Option(rich_help_panel=SAMPLING_PANEL,
        help="No n-gram of this size occurs twice in the prompt and the output, greedy included (0: off; "
        "transformers').")] = SamplingSettings.no_repeat_ngram_size,
    bad_words: Annotated[Optional[list[str]], typer.Option("--bad-words", rich_help_panel=SAMPLING_PANEL,
        help="A word never generated (vLLM's bad_words); repeatable.")] = None,
    dry_multiplier: Annotated[float, typer.Option(rich_help_panel=SAMPLING_PANEL,
        help="DRY (llama.cpp's): a token that would extend a repetition of N >= --dry-allowed-length tokens of the prompt "
        "and the output loses MULTIPLIER * BASE ^ (N - allowed length) from its logit, greedy included (0: off).")] = SamplingSettings.dry_multiplier,
    dry_base: Annotated[float, typer.Option(rich_help_panel=SAMPLING_PANEL,
        help="DRY's penalty base (>= 1).")] = SamplingSettings.dry_base,
    dry_allowed_length: Annotated[int, typer.Option(rich_help_panel=SAMPLING_PANEL,
        help="DRY leaves repetitions of up to this many tokens alone (>= 1).")] = SamplingSettings.dry_allowed_length,
    dry_penalty_last_n: Annotated[int, typer.Option(rich_help_panel=SAMPLING_PANEL,
        help="DRY scans this many of the last tokens (-1: all, 0: off).")] = SamplingSettings.dry_penalty_last_n,
    dry_sequence_breaker: Annotated[Optional[list[str]], typer.Option("--dry-sequence-breaker", rich_help_panel=SAMPLING_PANEL,
        help="A string a DRY repetition never reaches back across; repeatable, replacing the default (newline, :, \", *); "
        "none: no breakers (llama.cpp's option; a newline in bash: $'\\n').")] = None,
    presence_penalty: Annotated[float, typer.Option(
        rich_help_panel=SAMPLING_PANEL,
        help="Subtracted from the logit of every token already generated, in [-2, 2] (OpenAI's).")] = SamplingSettings.presence_penalty,
    frequency_penalty: Annotated[float, typer.Option(
        rich_help_panel=SAMPLING_PANEL,
        help="Subtracted from a token's logit once per time it was generated, in [-2, 2] (OpenAI's).")] = SamplingSettings.frequency_penalty,
    repetition_penalty: Annotated[float, typer.Option(
        rich_help_panel=SAMPLING_PANEL, help="The logits of tokens in the prompt or the output divided by it (multiplied where negative); "
        "> 0, 1: off (transformers' and vLLM's).")] = SamplingSettings.repetition_penalty,
    logit_bias: Annotated[Optional[list[str]], typer.Option(
        "--logit-bias", metavar="ID=BIAS",
        rich_help_panel=SAMPLING_PANEL, help="Add BIAS (in [-100, 100]) to token ID's logit, greedy included; repeatable, or a comma list "
        "(-100: never, 100: always).")] = None,
    stop_token_ids: Annotated[Optional[list[str]], typer.Option(
        "--stop-token-ids", metavar="IDS",
        rich_help_panel=SAMPLING_PANEL, help="A sample ends when it generates one of these token ids (not kept); comma list, repeatable.")] = None,
    min_tokens: Annotated[int, typer.Option(
        rich_help_panel=SAMPLING_PANEL, help="<|endoftext|> and --stop-token-ids cannot be generated before this many tokens.")] = SamplingSettings.min_tokens,
    ignore_eos: Annotated[bool, typer.Option(
        "--ignore-eos", rich_help_panel=SAMPLING_PANEL, help="Do not stop at <|endoftext|> (it is kept as a token).")] = SamplingSettings.ignore_eos,
    n: Annotated[int, typer.Option(
        "--n", "--num-return-sequences",
        help="Samples per prompt; sample i is seeded SEED + i (vLLM's rule), so sample 0 is what --n 1 gives.")] = SamplingSettings.n,
    json_schema: Annotated[Optional[Path], typer.Option(
        "--json-schema", metavar="FILE", rich_help_panel=STRUCTURED_PANEL,
        help="Structured output: the text is JSON satisfying this JSON schema file.")] = None,
    regex: Annotated[Optional[str], typer.Option(rich_help_panel=STRUCTURED_PANEL,
        help="Structured output: the text fully matches this regular expression.")] = None,
    choice: Annotated[Optional[list[str]], typer.Option(
        "--choice", rich_help_panel=STRUCTURED_PANEL, help="Structured output: the text is one of these (repeatable).")] = None,
    grammar: Annotated[Optional[Path], typer.Option(
        "--grammar", metavar="FILE", rich_help_panel=STRUCTURED_PANEL,
        help="Structured output: the text satisfies this Lark (start:) or GBNF (root ::=) grammar.")] = None,
    num_beams: Annotated[int, typer.Option(rich_help_panel=BEAM_PANEL, help="Beam search with this many beams (1: off).")] = SamplingSettings.num_beams,
    length_penalty: Annotated[float, typer.Option(
        rich_help_panel=BEAM_PANEL, help="Beam search length penalty (as in transformers).")] = SamplingSettings.length_penalty,
    early_stopping: Annotated[bool, typer.Option(
        rich_help_panel=BEAM_PANEL, help="Beam search stops once num_beams hypotheses are done.")] = SamplingSettings.early_stopping,
    prompts_file: Annotated[Optional[Path], typer.Option(help="One prompt per line, generated as one left-padded batch.")] = None,
    truncate: Annotated[bool, typer.Option(help="Keep the end of prompts longer than the context instead of failing.")] = False,
    draft: Annotated[Optional[str], typer.Option(
        rich_help_panel=DRAFT_PANEL, help=f"Speculative decoding with this draft: {DRAFT_HELP}. The output is the target's own.")] = None,
    num_speculative_tokens: NumSpeculativeTokensOpt = DraftSettings.num_speculative_tokens,
    draft_adaptive: Annotated[bool, typer.Option(
        rich_help_panel=DRAFT_PANEL, help="Adapt K to acceptance and fall back to plain decoding while drafting does not pay (timed); "
        "--no-draft-adaptive always drafts K, so that a seeded sampled run is reproduced exactly.")] = True,
    kv_cache: KvCacheOpt = KvCache.auto,
    as_json: JsonOpt = False,
) -> None:
    """Generate text from a prompt (streamed to stdout) or from a file of prompts (one batch)."""
    if prompt is not None and prompts_file is not None:
        raise UsageError("give a PROMPT or --prompts-file, not both")
    backend = choose_backend(backend, precision, provider, onnx_dir)
    if onnx_dir is not None:
        refuse_export_folder(backend, "--onnx")
    refuse_kv_cache(kv_cache, backend)
    refuse_int8_kv(precision, onnx_dir, backend)
    prompts = read_prompts_file(prompts_file) if prompts_file else [prompt or ""]
    if seed is None:
        seed = int.from_bytes(os.urandom(4), "little")
    settings = SamplingSettings(
        max_new_tokens=max_new_tokens, greedy=greedy, temperature=temperature, top_k=top_k, top_p=top_p,
        seed=seed, num_beams=num_beams, length_penalty=length_penalty, early_stopping=early_stopping,
        min_p=min_p, typical_p=typical_p, no_repeat_ngram_size=no_repeat_ngram_size, bad_words=tuple(bad_words or ()),
        dry_multiplier=dry_multiplier, dry_base=dry_base, dry_allowed_length=dry_allowed_length,
        dry_penalty_last_n=dry_penalty_last_n, dry_sequence_breakers=dry_breakers(dry_sequence_breaker),
        presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
        repetition_penalty=repetition_penalty, logit_bias=parse_logit_bias(logit_bias or []),
        stop_token_ids=parse_token_ids(stop_token_ids or [], "--stop-token-ids"), min_tokens=min_tokens,
        ignore_eos=ignore_eos, n=n, constraint=constraint_from(json_schema, regex, choice, grammar),
    )
    draft_settings = DraftSettings(num_speculative_tokens=num_speculative_tokens, adaptive=draft_adaptive)
    if draft is not None and num_beams > 1:
        raise UsageError("--draft and --num-beams do not combine: speculative decoding samples or decodes greedily")
    if draft is not None:  # what can be refused before the target loads (its vocabulary is checked once it has)
        check_draft(draft, backend, provider, revision=revision)
    with Status("starting") as status:
        runner = open_backend(backend, provider, model, revision, precision, onnx_dir, threads,
                              progress=progress_to(status), notice=notice, in_place_kv=kv_cache.in_place_kv,
                              prefill_tokens=most_step_tokens(prompts, settings, draft_settings if draft else None))
        drafter = None if draft is None else open_drafter(draft, runner, backend, provider, None, draft_settings, revision,
                                                          progress=progress_to(status), notice=notice)
    stream = len(prompts) == 1 and not as_json and num_beams == 1 and n == 1
    decoder = StreamDecoder()
    shown = []  # the prompt, written with the first token: a generation refused before its first writes nothing

    def write_token(row: int, tok: int) -> None:
        sys.stdout.write(("" if shown else prompts[0]) + decoder.push(tok))
        sys.stdout.flush()
        shown.append(True)

    results = run_generation(runner, prompts, settings, truncate=truncate, on_token=write_token if stream else None,
                             draft=drafter, draft_settings=draft_settings, fixed_cache=kv_cache.fixed_cache(provider))
    if stream:
        sys.stdout.write(("" if shown else prompts[0]) + decoder.flush() + "\n")
    elif as_json:
        for i, r in enumerate(results):
            print(json.dumps({
                "prompt": r.prompt, "prompt_tokens": r.prompt_tokens, "tokens": r.tokens, "text": decode(r.tokens),
                "finish_reason": r.finish_reason, "model": runner.model_name, "backend": runner.name,
                "seed": seed + i % n,  # sample i of a prompt: seed + i
                **({"sample": i % n} if n > 1 else {}),
                **({"draft": drafter.name, "speculation": r.speculation} if drafter is not None else {}),
                **({"decoder": r.decoder} if r.decoder is not None else {}),
            }))
    else:
        for i, r in enumerate(results):
            if i:
                print()
            print(r.prompt + decode(r.tokens))
    if drafter is not None and not as_json:
        for r in results:
            st = r.speculation
            rate = "no tokens drafted" if not st["drafted"] else (
                f"{st['accepted']}/{st['drafted']} drafted tokens accepted ({st['acceptance_rate']:.0%}), "
                f"mean acceptance length {st['mean_acceptance_length']:.2f}")
            err.print(f"draft {drafter.name}: {rate}; {st['plain_steps']} plain steps", markup=False)
    for r in results:
        if r.finish_reason == "context":
            err.print(f"note: stopped at the model's context limit ({runner.n_positions} tokens)")
            break
