"""The benchmark scripts' `--json-out PATH`: their results as indented JSON, written only when
the flag is given, so that every script's file reads the same way."""
from __future__ import annotations

import json
from typing import Any


def write_json_out(path: str | None, results: Any, **dump_options: Any) -> None:
    """Write `results` to `path` (indent 1; `dump_options` go to json.dump); nothing when `path` is empty."""
    if path:
        with open(path, "w") as f:
            json.dump(results, f, indent=1, **dump_options)
