"""Command line: ``stree generate --target DIR [--draft DIR] --prompt TEXT ...``.

Streams the new text as tokens are accepted (stdout), shows a progress bar (stderr; tqdm if
installed), then prints the statistics (stderr). Models load from local directories only, in any
layout :mod:`stree.checkpoints` knows; the tokenizer is ``--tokenizer`` (a ``tokenizer.json`` or
its directory), else the target's.

Bad input (a missing or broken model directory, an empty prompt, an unknown tree, a non-lossless
verifier, bad sampling values, a model stree cannot patch) ends with one ``error: ...`` line on
stderr and exit status 1; ``--debug`` shows the traceback instead (:mod:`stree.errors`).
"""
from __future__ import annotations

import argparse
import sys

import torch

from stree.checkpoints import (DTYPES, check_model_dir, default_eos, encode_prompt, load_role, load_tokenizer,
                               model_config, reported_as)
from stree.errors import add_debug_flag, guarded
from stree.inputs import available_device


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="stree", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate text with speculative tree decoding")
    g.add_argument("--target", required=True, help="target model directory")
    g.add_argument("--draft", help="draft model directory (not needed for --method ar or a suffix "
                                   "tree, --tree suffix:16)")
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-file", help="file holding the prompt text")
    g.add_argument("--method", default="tree", choices=["tree", "chain", "ar", "ar-tree", "unrolled"],
                   help="ar: the model's own autoregressive decoding; ar-tree: stree's 1-node tree path")
    g.add_argument("--tree", default=None,
                   help="drafter: fig4a | A..E | beam:NxM | chain:K | static:W1,W2,... | caterpillar:C1,C2,... | "
                        "dyspec:N[:D[:VT]] | dyspec-paper:N | dyspec-threshold:T | dynatree:DxB:N | dynatree2 | "
                        "suffix:N[:key=value,...] (no draft model) | TREE+suffix:N (merged) | auto "
                        "(default: caterpillar:2,2,2 on a CPU, fig4a on a GPU; chain:4 for "
                        "--method chain)")
    g.add_argument("--verifier", default=None,
                   choices=["greedy", "mss", "naive", "sps", "asps", "mss+asps", "block",
                            "traversal"],
                   help="default: the lossless one for the sampling config and drafter "
                        "(mss+asps: asps for sampled chains, mss for trees, per draft)")
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--max-new-tokens", type=int, default=256)
    g.add_argument("--tokenizer", help="tokenizer.json or its directory (default: the target's)")
    g.add_argument("--eos-token-id", type=int, nargs="+", default=None, metavar="ID",
                   help="stop token id(s) (default: every eos_token_id of the target's config.json "
                        "and generation_config.json, else the tokenizer's end-of-text tokens); "
                        "-1 disables")
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    g.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                   help="default bfloat16 on CUDA, float32 on CPU")
    g.add_argument("--model-type", choices=["auto", "transformers", "hybrid", "mamba"], default="auto",
                   help="checkpoint layout (auto: transformers if config.json names a supported class, "
                        "hybrid if mamba_config.json exists, else mamba)")
    g.add_argument("--compile", action="store_true",
                   help="run the verify step and draft levels compiled (torch.compile with frozen "
                        "weights; static trees, methods tree, chain, ar-tree), or with --method ar "
                        "the model's own step on a static cache (MambaInLlama checkpoints)")
    g.add_argument("--no-prepack", action="store_true",
                   help="CPU fp32: keep PyTorch's plain linear layers instead of prepacked weights "
                        "(stree.prepack_linears; both the model's own decoding and stree use them)")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_debug_flag(g)
    from stree import demo

    demo.build_parser(sub.add_parser("demo", help=demo.__doc__.split("\n")[0]))
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "demo":
        from stree import demo

        return guarded(demo.run, args)
    return guarded(run_generate, args)


def run_generate(args) -> int:
    from stree.generation import generate, resolve
    from stree.sampling import SamplingConfig

    no_tree = args.method in ("ar", "ar-tree")
    if no_tree and (args.tree or args.verifier):
        raise ValueError(f"--method {args.method} drafts and verifies nothing: drop --tree/--verifier")
    if args.max_new_tokens < 0:
        raise ValueError(f"--max-new-tokens must be >= 0, got {args.max_new_tokens}")
    if args.seed is not None and not -2**63 <= args.seed < 2**64:
        raise ValueError(f"--seed must fit in 64 bits, got {args.seed}")
    # Validate the cheap things before loading models: device, sampling values, tree spec,
    # verifier pair, model directories.
    device = available_device(args.device)
    drafter = None if no_tree else args.tree  # None: generate's default for the method and device
    resolved, _ = resolve(args.method, drafter, args.verifier,
                          SamplingConfig(args.temperature, args.top_k, args.top_p), args.compile, device,
                          draft_model=bool(args.draft))
    no_draft = not resolved.uses_draft_model
    if not no_draft and not args.draft:
        raise ValueError(f"--draft DIR is required for --method {args.method} with --tree "
                         f"{resolved.name} (a suffix tree, --tree suffix:16, and --method ar / ar-tree "
                         "run without a draft model)")
    if no_draft and args.draft and not no_tree:
        raise ValueError(f"--tree {resolved.name} runs no draft model: drop --draft, or merge the "
                         f"draft's tree with it (--tree caterpillar:2,2,2+{resolved.name})")
    for role, directory in (("target", args.target), ("draft", None if no_draft else args.draft)):
        if directory is not None:
            with reported_as(role, directory):
                check_model_dir(directory)
    text = read_prompt(args)
    dtype = DTYPES[args.dtype] if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    tokenizer = load_tokenizer(args.tokenizer or args.target)
    ids = encode_prompt(tokenizer, text, model_config(args.target).get("bos_token_id"))
    target = load_role("target", args.target, device, dtype, args.model_type, not args.no_prepack)
    draft = None if no_draft else load_role("draft", args.draft, device, dtype, args.model_type,
                                            not args.no_prepack)
    eos = args.eos_token_id if args.eos_token_id is not None else default_eos(args.target, tokenizer)
    generator = None
    if args.seed is not None:
        generator = torch.Generator(device=device).manual_seed(args.seed)
    streamer = TextStreamer(tokenizer, args.max_new_tokens, progress=not args.no_progress)
    try:
        out = generate(target, draft, torch.tensor([ids], device=device), args.max_new_tokens,
                       temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                       eos_token_id=None if -1 in eos else eos,
                       drafter=drafter, verifier=args.verifier, method=args.method,
                       generator=generator, streamer=streamer, compile=args.compile)
    except KeyboardInterrupt:
        streamer.interrupt()
        raise
    print(out.stats.summary(), file=sys.stderr)
    return 0


def read_prompt(args) -> str:
    """The prompt text of ``--prompt`` / ``--prompt-file``; ValueError if it is empty."""
    if args.prompt is not None:
        text, where = args.prompt, "--prompt"
    else:
        where = f"--prompt-file {args.prompt_file}"
        try:
            with open(args.prompt_file, encoding="utf-8") as f:
                text = f.read()
        except OSError as err:
            raise ValueError(f"{where}: {err.strerror or err}") from None
        except UnicodeDecodeError as err:
            raise ValueError(f"{where}: not UTF-8 text ({err.reason} at byte {err.start})") from None
    if not text:
        raise ValueError(f"the prompt is empty ({where}): generation needs at least one prompt token")
    return text


# ---------------------------------------------------------------------------------- streaming
class TextStreamer:
    """``generate``'s streamer: prints the decoded continuation as tokens are accepted.

    Decoding is incremental (as vLLM's detokenizer): each ``put`` decodes a window from the start
    of the previously printed chunk, with and without the new tokens, and prints the difference;
    the window never covers the whole output. Decoding from one chunk back keeps tokenizers that
    drop a leading space at the start of a decode correct, and text is held back while it ends in
    an incomplete multi-byte character (a BPE token can carry part of one). The progress bar goes
    to stderr only when stdout is not a terminal (text to a file or pipe); on a terminal the
    streamed text is the progress, so nothing is drawn between its lines.
    """

    def __init__(self, tokenizer, total: int, progress: bool = True, out=None, err=None):
        self.tokenizer, self.out, self.err = tokenizer, out or sys.stdout, err or sys.stderr
        self.tokens: list[int] = []
        self.prefix = self.read = 0  # window start; tokens[:read] have been printed
        self.prompt_seen = self.ended = False
        # drawn from the first new token on, so that what generate prints first (a warning that
        # it capped max_new_tokens) is not written into the bar's line
        self.total, self.bar = total, None
        self.show_bar = progress and not _isatty(self.out)

    def put(self, tokens: torch.Tensor) -> None:
        if not self.prompt_seen:  # the first put is the prompt
            self.prompt_seen = True
            return
        new = tokens.view(-1).tolist()
        self.tokens += new
        if self.show_bar and self.bar is None and not self.ended:
            self.bar = _progress_bar(self.total, self.err)
        printed, text = self._window()
        if len(text) > len(printed) and not text.endswith("\ufffd"):  # complete characters only
            self._write(text[len(printed):])
            self.prefix, self.read = self.read, len(self.tokens)
        if self.bar is not None:
            self.bar.update(len(new))

    def end(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        printed, text = self._window()
        self._write(text[len(printed):] + "\n")
        self.prefix = self.read = len(self.tokens)
        self.ended = True

    def interrupt(self) -> None:
        """Ctrl-C during generation: clear the progress bar, print the text decoded so far (held
        back characters too) and end its line, so that the one-line message after it stands
        alone."""
        if not self.ended and self.tokens:
            self.end()
        elif self.bar is not None:
            self.bar.close()
            self.bar = None

    def _window(self) -> tuple[str, str]:
        """(decoded printed part of the window, decoded whole window)."""
        decode = self.tokenizer.decode
        return decode(self.tokens[self.prefix:self.read]), decode(self.tokens[self.prefix:])

    def _write(self, text: str) -> None:
        self.out.write(text)
        self.out.flush()


def _isatty(stream) -> bool:
    return bool(getattr(stream, "isatty", lambda: False)())


class _SimpleBar:
    """Fallback progress bar: ``tokens n/total`` redrawn in place."""

    def __init__(self, total: int, file):
        self.n, self.total, self.file = 0, total, file

    def update(self, n: int) -> None:
        self.n += n
        self.file.write(f"\r{self.n}/{self.total} tokens")
        self.file.flush()

    def close(self) -> None:
        self.file.write("\n")


class _TqdmBar:
    """tqdm behind the same two verbs."""

    def __init__(self, total: int, file):
        from tqdm.auto import tqdm

        self.bar = tqdm(total=total, file=file, unit="tok", leave=False, dynamic_ncols=True)

    def update(self, n: int) -> None:
        self.bar.update(n)

    def close(self) -> None:
        self.bar.close()


def _progress_bar(total: int, file):
    try:
        return _TqdmBar(total, file)
    except ImportError:
        return _SimpleBar(total, file)


if __name__ == "__main__":
    sys.exit(main())
