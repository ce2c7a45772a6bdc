"""Write docs/recipe_reference.md: every recipe key, its default and its --help text, from fsdp_trainer/config/.

python tools/recipe_reference.py [OUT]        # default: docs/recipe_reference.md beside this folder
"""

from __future__ import annotations

import sys
from pathlib import Path

from fsdp_trainer.files import write_atomic
from fsdp_trainer.reference import recipe_reference


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        return
    out = Path(argv[0]) if argv else Path(__file__).resolve().parents[1] / "docs" / "recipe_reference.md"
    write_atomic(out, recipe_reference())
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
