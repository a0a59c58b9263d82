"""The longer run of ``doc_code/weight_sync_qwen2.py``: the same code (this file runs that one as ``__main__``), a
bigger Qwen2 and more optimizer steps. Defaults: 30 steps of a 4-layer model, hidden 256, 8 query heads over 2 KV
heads (one KV head per engine rank, Qwen2.5-0.5B's case), vocabulary 4096, sequences of 64, 16 greedy tokens per
prompt; every step checked as in the CI run (engines' logits and greedy tokens against the trainer's, the fence).
Any of the example's options given here override those defaults (``--help`` lists them).

Install: pip install torch==2.13.0 -e ".[test]"   (transformers comes with the test extra)
Run:     python examples/weight_sync_qwen2_long.py [--steps 100 ...]
"""

import runpy
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parent.parent / "doc_code" / "weight_sync_qwen2.py"
LONG = ["--steps", "30", "--vocab", "4096", "--hidden", "256", "--inter", "768", "--layers", "4", "--heads", "8",
        "--kv-heads", "2", "--seq", "64", "--prompts", "8", "--prompt-len", "16", "--new-tokens", "16"]

if __name__ == "__main__":
    sys.argv = [str(EXAMPLE), *LONG, *sys.argv[1:]]  # argparse: a later option wins over the default above
    runpy.run_path(str(EXAMPLE), run_name="__main__")
