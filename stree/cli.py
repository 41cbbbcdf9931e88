"""Command line: ``stree generate --target DIR [--draft DIR] --prompt TEXT ...``.

Streams the new text as tokens are accepted (stdout), shows a progress bar (stderr; tqdm if
installed), then prints the statistics (stderr). Models load from local directories only:

* a directory with ``mamba_config.json``: a MambaInLlama hybrid (``stree.hybrid``);
* otherwise mamba_ssm's ``MambaLMHeadModel`` layout: ``config.json`` + ``pytorch_model.bin``
  (or ``model.safetensors``), built and loaded the way mamba_ssm's ``from_pretrained`` does,
  without the hub.

The tokenizer is a ``tokenizer.json`` (Hugging Face ``tokenizers``): ``--tokenizer`` (the file or
its directory), else the one in the target's directory.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

import torch

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
# End-of-text tokens of the tokenizers the supported model families ship with.
EOS_TOKENS = ("<|endoftext|>", "<|end_of_text|>", "<|eot_id|>", "</s>")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="stree", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate text with speculative tree decoding")
    g.add_argument("--target", required=True, help="target model directory")
    g.add_argument("--draft", help="draft model directory (not needed for --method ar)")
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-file", help="file holding the prompt text")
    g.add_argument("--method", default="tree", choices=["tree", "chain", "ar", "unrolled"])
    g.add_argument("--tree", default=None,
                   help="drafter: fig4a | A..E | beam:NxM | chain:K | static:W1,W2,... | dyspec:N | "
                        "dyspec-threshold:T | dynatree:DxB:N | dynatree2 | auto "
                        "(default: fig4a; chain:4 for --method chain)")
    g.add_argument("--verifier", default=None, choices=["greedy", "mss", "naive", "sps", "asps"],
                   help="default: the lossless one for the sampling config and drafter")
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--max-new-tokens", type=int, default=256)
    g.add_argument("--tokenizer", help="tokenizer.json or its directory (default: the target's)")
    g.add_argument("--eos-token-id", type=int, default=None,
                   help="stop token (default: the model config's, else the tokenizer's "
                        "end-of-text token); -1 disables")
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    g.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                   help="default bfloat16 on CUDA, float32 on CPU")
    g.add_argument("--model-type", choices=["auto", "hybrid", "mamba"], default="auto",
                   help="checkpoint layout (auto: hybrid iff mamba_config.json exists)")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    from stree import demo

    demo.build_parser(sub.add_parser("demo", help=demo.__doc__.split("\n")[0]))
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "generate":
        return run_generate(args)
    if args.command == "demo":
        from stree import demo

        return demo.run(args)
    return 2


def run_generate(args) -> int:
    from stree.generate import generate

    if args.method != "ar" and not args.draft:
        raise SystemExit(f"--draft is required for --method {args.method}")
    device = torch.device(args.device)
    dtype = DTYPES[args.dtype] if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    tokenizer = load_tokenizer(args.tokenizer or args.target)
    target = load_model(args.target, device, dtype, args.model_type)
    draft = load_model(args.draft, device, dtype, args.model_type) if args.method != "ar" else None
    if args.prompt is not None:
        text = args.prompt
    else:
        with open(args.prompt_file, encoding="utf-8") as f:
            text = f.read()
    ids = torch.tensor(tokenizer.encode(text).ids, dtype=torch.long, device=device)
    eos = args.eos_token_id if args.eos_token_id is not None else default_eos(args.target, tokenizer)
    drafter = args.tree
    if drafter is None and args.method == "chain":
        drafter = "chain:4"
    generator = None
    if args.seed is not None:
        generator = torch.Generator(device=device).manual_seed(args.seed)
    streamer = TextStreamer(tokenizer, args.max_new_tokens, progress=not args.no_progress)
    out = generate(target, draft, ids[None], args.max_new_tokens, temperature=args.temperature,
                   top_k=args.top_k, top_p=args.top_p,
                   eos_token_id=None if eos is None or eos < 0 else eos,
                   drafter=None if args.method == "ar" else drafter, verifier=args.verifier,
                   method=args.method, generator=generator, streamer=streamer)
    print(out.stats.summary(), file=sys.stderr)
    return 0


# ------------------------------------------------------------------------------------ loading
def load_model(directory: str, device, dtype, model_type: str = "auto"):
    """A patched model from a local checkpoint directory (see the module docstring)."""
    import stree

    if not os.path.isdir(directory):
        raise SystemExit(f"model directory not found: {directory}")
    hybrid = os.path.exists(os.path.join(directory, "mamba_config.json"))
    if model_type == "hybrid" and not hybrid:
        raise SystemExit(f"{directory} has no mamba_config.json: not a MambaInLlama hybrid checkpoint")
    if model_type == "hybrid" or (model_type == "auto" and hybrid):
        from stree.hybrid import MambaInLlamaForCausalLM

        model = MambaInLlamaForCausalLM.from_pretrained(directory, dtype=dtype, device=device)
    else:
        model = _load_mamba_lm(directory, device, dtype)
    return stree.patch(model.eval())


def _load_mamba_lm(directory: str, device, dtype):
    from stree._mamba import mamba_ssm  # noqa: F401
    from mamba_ssm.models.config_mamba import MambaConfig
    from mamba_ssm.models.mixer_seq_simple import MambaLMHeadModel

    with open(os.path.join(directory, "config.json"), encoding="utf-8") as f:
        raw = json.load(f)
    known = {f.name for f in dataclasses.fields(MambaConfig)}
    model = MambaLMHeadModel(MambaConfig(**{k: v for k, v in raw.items() if k in known}),
                             device=device, dtype=dtype)
    bin_path = os.path.join(directory, "pytorch_model.bin")
    st_path = os.path.join(directory, "model.safetensors")
    if os.path.exists(bin_path):
        state = torch.load(bin_path, map_location="cpu", weights_only=True)
    elif os.path.exists(st_path):
        from safetensors.torch import load_file

        state = load_file(st_path)
    else:
        raise SystemExit(f"{directory}: neither pytorch_model.bin nor model.safetensors found")
    model.load_state_dict(state)
    return model


def load_tokenizer(path: str):
    """``tokenizers.Tokenizer`` from a tokenizer.json file or a directory holding one."""
    from tokenizers import Tokenizer

    file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
    if not os.path.exists(file):
        raise SystemExit(f"no tokenizer.json at {path}; pass --tokenizer FILE_OR_DIR")
    return Tokenizer.from_file(file)


def default_eos(model_dir: str, tokenizer) -> int | None:
    """The model config's ``eos_token_id`` (first if a list), else the tokenizer's end-of-text."""
    cfg = os.path.join(model_dir, "config.json")
    if os.path.exists(cfg):
        with open(cfg, encoding="utf-8") as f:
            eos = json.load(f).get("eos_token_id")
        if isinstance(eos, list):
            eos = eos[0] if eos else None
        if eos is not None:
            return int(eos)
    return next((tokenizer.token_to_id(t) for t in EOS_TOKENS if tokenizer.token_to_id(t) is not None), None)


# ---------------------------------------------------------------------------------- streaming
class TextStreamer:
    """``generate``'s streamer: prints the decoded continuation as tokens are accepted.

    Decodes all new tokens each time and prints what was added (a token can change how the text
    before it decodes, e.g. a multi-byte character split over tokens). When stdout and stderr are
    the same terminal, text goes out line by line through the progress bar so the bar stays below.
    """

    def __init__(self, tokenizer, total: int, progress: bool = True, out=None, err=None):
        self.tokenizer, self.out, self.err = tokenizer, out or sys.stdout, err or sys.stderr
        self.tokens: list[int] = []
        self.shown = 0
        self.pending_line = ""
        self.prompt_seen = False
        self.bar = _progress_bar(total, self.err) if progress else None
        self.shared_tty = self.out.isatty() and self.err.isatty()

    def put(self, tokens: torch.Tensor) -> None:
        if not self.prompt_seen:  # the first put is the prompt
            self.prompt_seen = True
            return
        new = tokens.view(-1).tolist()
        self.tokens += new
        text = self.tokenizer.decode(self.tokens)
        if text.endswith("\ufffd"):  # incomplete multi-byte character: wait for the rest
            text = text[:-1]
        delta, self.shown = text[self.shown:], max(self.shown, len(text))
        if self.bar is not None:
            self.bar.update(len(new))
        self._write(delta)

    def end(self) -> None:
        self._write(self.tokenizer.decode(self.tokens)[self.shown:] + "\n")
        if self.bar is not None:
            self.bar.close()

    def _write(self, text: str) -> None:
        if not text:
            return
        if self.bar is None or not self.shared_tty:
            self.out.write(text)
            self.out.flush()
            return
        *lines, self.pending_line = (self.pending_line + text).split("\n")
        for line in lines:
            self.bar.write(line, file=self.out)


class _SimpleBar:
    """Fallback progress bar: ``tokens n/total`` redrawn in place."""

    def __init__(self, total: int, file):
        self.n, self.total, self.file = 0, total, file

    def update(self, n: int) -> None:
        self.n += n
        self.file.write(f"\r{self.n}/{self.total} tokens")
        self.file.flush()

    def write(self, line: str, file) -> None:
        self.file.write("\r\033[K")
        file.write(line + "\n")
        self.update(0)

    def close(self) -> None:
        self.file.write("\n")


class _TqdmBar:
    """tqdm behind the same three verbs; ``write`` keeps the bar below the text."""

    def __init__(self, total: int, file):
        from tqdm.auto import tqdm

        self.tqdm = tqdm
        self.bar = tqdm(total=total, file=file, unit="tok", leave=False, dynamic_ncols=True)

    def update(self, n: int) -> None:
        self.bar.update(n)

    def write(self, line: str, file) -> None:
        self.tqdm.write(line, file=file)

    def close(self) -> None:
        self.bar.close()


def _progress_bar(total: int, file):
    try:
        return _TqdmBar(total, file)
    except ImportError:
        return _SimpleBar(total, file)


if __name__ == "__main__":
    sys.exit(main())
