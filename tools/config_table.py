"""Print docs/configuration.md's table of every key from the section models' field docstrings
(``trainwright/config/sections.py``; pydantic keeps each as the field's description)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's package
from trainwright.config import SECTIONS, Config  # noqa: E402


def main() -> None:
    """Print the markdown table."""
    cfg = Config()
    print("| key | default | meaning |\n|---|---|---|")
    for section, cls in SECTIONS.items():
        for name, info in cls.model_fields.items():
            value = getattr(getattr(cfg, section), name)
            meaning = " ".join((info.description or "").split())
            print(f"| `{section}.{name}` | `{value!r}` | {meaning} |")


if __name__ == "__main__":
    main()
