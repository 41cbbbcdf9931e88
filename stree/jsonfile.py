"""Reading the JSON files of a checkpoint directory, with errors that name the file."""
from __future__ import annotations

import json
import os


def read_json(path: str) -> dict:
    """The object in the JSON file at ``path``, or {} if there is no such file.

    Raises:
        ValueError: the file exists but is not valid JSON (the message names it).
    """
    if not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{path} is not valid JSON ({err})") from err
