"""How the command-line programs (``stree generate``, ``stree demo``) report failures: any error
becomes one ``error: ...`` line on stderr and exit status 1 (``--debug`` shows the traceback
instead), a warning one ``warning: ...`` line, Ctrl-C exit status 130 with the text so far."""
from __future__ import annotations

import sys
import warnings


def add_debug_flag(parser) -> None:
    parser.add_argument("--debug", action="store_true",
                        help="show the Python traceback of an error instead of one line")


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
