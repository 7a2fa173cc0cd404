"""``python -m bench``: see ``bench/__init__.py`` and ``python -m bench --help``."""

from bench._driver import main

raise SystemExit(main())
