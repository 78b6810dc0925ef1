"""``python -m napari_tileshard`` runs the command line (record, verify, convert, gui)."""

import sys

from .apps.cli import main

sys.exit(main())
