"""``python -m weightstream.integrations.ai_toolkit RUN_PY ARGS...``: see ``launcher``."""

from weightstream.integrations.ai_toolkit.launcher import main

raise SystemExit(main())
