"""``python -m trainwright.cli``."""

from trainwright.cli.main import main

raise SystemExit(main())
