"""``python -m pagedrs.server [MODEL] [flags]``: the same as ``pagedrs serve``."""

import sys

from pagedrs.server.launch import main

sys.exit(main())
