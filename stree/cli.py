"""Command line: ``stree generate --target DIR [--draft DIR] --prompt TEXT ...``.

Streams the new text as tokens are accepted (stdout), shows a progress bar (stderr; tqdm if
installed), then prints the statistics (stderr). Models load from local directories only:

* a ``config.json`` naming a transformers Mamba2-family class (``architectures``): loaded with
  transformers' own ``from_pretrained`` (``stree.hf``), its tokenizer with ``AutoTokenizer``;
* a directory with ``mamba_config.json``: a MambaInLlama hybrid (``stree.hybrid``);
* otherwise mamba_ssm's ``MambaLMHeadModel`` layout: ``config.json`` + ``pytorch_model.bin``
  (or ``model.safetensors``), built and loaded the way mamba_ssm's ``from_pretrained`` does,
  without the hub.

The tokenizer is a ``tokenizer.json`` (Hugging Face ``tokenizers``): ``--tokenizer`` (the file or
its directory), else the one in the target's directory.

Bad input (a missing or broken model directory, an empty prompt, an unknown tree, a non-lossless
verifier, bad sampling values, a model stree cannot patch) ends with one ``error: ...`` line on
stderr and exit status 1; ``--debug`` shows the traceback instead.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import warnings
from contextlib import contextmanager

import torch

from stree.inputs import available_device
from stree.jsonfile import read_json

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
# End-of-text tokens of the tokenizers the supported model families ship with.
EOS_TOKENS = ("<|endoftext|>", "<|end_of_text|>", "<|eot_id|>", "</s>")


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
                   choices=["greedy", "mss", "naive", "sps", "asps", "mss+asps"],
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


def add_debug_flag(parser) -> None:
    parser.add_argument("--debug", action="store_true",
                        help="show the Python traceback of an error instead of one line")


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "demo":
        from stree import demo

        return guarded(demo.run, args)
    return guarded(run_generate, args)


def guarded(run, args) -> int:
    """``run(args)``, with any error printed as one ``error: ...`` line (exit status 1) unless
    ``args.debug``, where it propagates with its traceback."""
    try:
        with warnings.catch_warnings():
            warnings.showwarning = _show_warning
            return run(args)
    except KeyboardInterrupt:  # Ctrl-C: the text so far is flushed (TextStreamer.interrupt)
        sys.stdout.flush()
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as err:  # noqa: BLE001 - the command line's last line of defence
        if getattr(args, "debug", False):
            raise
        print(f"error: {describe_error(err)}", file=sys.stderr)
        return 1


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """Warnings as one ``warning: ...`` line (a capped ``--max-new-tokens``, see
    ``stree.limits``), not Python's two lines of source location."""
    print(f"warning: {' '.join(str(message).split())}", file=file or sys.stderr)


def describe_error(err: BaseException) -> str:
    """One line: the message of errors stree raises on bad input, else the type and message."""
    msg = " ".join(str(err).split())
    if isinstance(err, (ValueError, TypeError, OSError)) and msg:
        return msg
    return f"{type(err).__name__}: {msg} (run with --debug for the traceback)"


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


def encode_prompt(tokenizer, text: str, bos_token_id: int | None) -> list[int]:
    """Token ids of ``text`` with the model's BOS in front (once: a tokenizer whose template
    already adds it is left alone). The CLI and the demo both encode prompts here."""
    ids = tokenizer.encode(text).ids
    if bos_token_id is not None and (not ids or ids[0] != bos_token_id):
        ids = [int(bos_token_id)] + ids
    if not ids:
        raise ValueError(f"the prompt {text!r} encodes to no tokens")
    return ids


# ------------------------------------------------------------------------------------ loading
def load_role(role: str, directory: str, device, dtype, model_type: str = "auto", prepack: bool = True):
    """:func:`load_model`, with any failure reported as ``"<role> model <dir>: <why>"``."""
    with reported_as(role, directory):
        return load_model(directory, device, dtype, model_type, prepack)


@contextmanager
def reported_as(role: str, directory: str):
    """Any failure inside the block as a :class:`ModelLoadError` ``"<role> model <dir>: <why>"``."""
    try:
        yield
    except Exception as err:
        raise ModelLoadError(f"{role} model {directory}: {describe_error(err)}") from err


class ModelLoadError(ValueError):
    """A model directory could not be turned into a patched model."""


def load_model(directory: str, device, dtype, model_type: str = "auto", prepack: bool = True):
    """A patched model from a local checkpoint directory (see the module docstring); on the CPU in
    fp32 its linear layers get prepacked weights (``stree.prepack_linears``) unless ``prepack`` is
    False: the model's own decoding and stree's run the same kernels."""
    model = _load_patched(directory, available_device(device), dtype, model_type)
    if prepack:
        from stree.layers.linear import prepack_linears

        prepack_linears(model)
    return model


def check_model_dir(directory: str) -> None:
    """FileNotFoundError unless ``directory`` exists and holds a ``config.json`` (naming the model
    directories inside it, if it holds some: the pair's folder instead of one of its models)."""
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"model directory not found: {directory}")
    if not os.path.exists(os.path.join(directory, "config.json")):
        subdirs = sorted(d for d in os.listdir(directory)
                         if os.path.exists(os.path.join(directory, d, "config.json")))
        hint = f" (it holds model directories {', '.join(subdirs)}: pass one of them)" if subdirs else ""
        raise FileNotFoundError(f"no config.json in {directory}: not a model checkpoint directory{hint}")


def _load_patched(directory: str, device, dtype, model_type: str):
    import stree
    from stree import hf

    check_model_dir(directory)
    if model_type == "transformers" or (model_type == "auto" and hf.is_checkpoint(directory)):
        return stree.patch(hf.load(directory, dtype=dtype, device=device))
    hybrid = os.path.exists(os.path.join(directory, "mamba_config.json"))
    if model_type == "hybrid" and not hybrid:
        raise ValueError(f"{directory} has no mamba_config.json: not a MambaInLlama hybrid checkpoint")
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

    from stree.hybrid.checkpoint import check_state_dict, read_weights

    raw = model_config(directory)
    missing = [k for k in ("d_model", "n_layer") if k not in raw]
    if missing:  # MambaConfig's defaults would build (and allocate) a 2.8B-parameter model
        llama = raw.get("model_type") == "llama" or "LlamaForCausalLM" in (raw.get("architectures") or [])
        why = (" (a Llama-style config.json: a MambaInLlama hybrid keeps its Mamba layers' settings in a "
               "mamba_config.json beside it, which is missing)" if llama else "")
        raise ValueError(f"{directory}/config.json is not a mamba-ssm config: it lacks "
                         f"{', '.join(missing)}{why}")
    known = {f.name for f in dataclasses.fields(MambaConfig)}
    model = MambaLMHeadModel(MambaConfig(**{k: v for k, v in raw.items() if k in known}),
                             device=device, dtype=dtype)
    bin_path = os.path.join(directory, "pytorch_model.bin")
    st_path = os.path.join(directory, "model.safetensors")
    if os.path.exists(bin_path):
        state = read_weights(bin_path)
    elif os.path.exists(st_path):
        state = read_weights(st_path)
    else:
        raise FileNotFoundError(f"{directory}: neither pytorch_model.bin nor model.safetensors found")
    tied = {"lm_head.weight"} if model.config.tie_embeddings else set()
    check_state_dict({k: v.shape for k, v in model.state_dict().items()}, state, optional=tied)
    model.load_state_dict(state, strict=not tied)
    return model


def model_config(directory: str) -> dict:
    """The parsed ``config.json`` of a model directory ({} if there is none)."""
    return read_json(os.path.join(directory, "config.json"))



def load_tokenizer(path: str):
    """``tokenizers.Tokenizer`` from a tokenizer.json file or a directory holding one (a transformers
    checkpoint directory: through ``AutoTokenizer``)."""
    from tokenizers import Tokenizer

    from stree import hf

    if os.path.isdir(path) and hf.is_checkpoint(path):
        return hf.load_tokenizer(path)

    file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
    if not os.path.exists(file):
        raise FileNotFoundError(f"no tokenizer.json at {path}; pass --tokenizer FILE_OR_DIR")
    try:
        return Tokenizer.from_file(file)
    except Exception as err:
        raise ValueError(f"{file} is not a readable tokenizer.json ({type(err).__name__}: "
                         f"{' '.join(str(err).split())})") from err


def default_eos(model_dir: str, tokenizer) -> list[int]:
    """Stop ids: every ``eos_token_id`` of ``config.json`` and ``generation_config.json`` (an id or
    a list; chat models end a turn with an id their config lists second, e.g. Llama-3.1's
    ``<|eot_id|>``), else the tokenizer's end-of-text tokens; [] if none is known."""
    ids: list[int] = []
    for name in ("config.json", "generation_config.json"):
        eos = read_json(os.path.join(model_dir, name)).get("eos_token_id")
        for t in eos if isinstance(eos, list) else [] if eos is None else [eos]:
            if int(t) not in ids:
                ids.append(int(t))
    if ids:
        return ids
    return [tokenizer.token_to_id(t) for t in EOS_TOKENS if tokenizer.token_to_id(t) is not None]


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
