"""The bundle's entry point (PyInstaller runs this file as __main__)."""
from beeswarm.cli import main

raise SystemExit(main())
