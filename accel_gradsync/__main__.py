"""`python -m accel_gradsync estimate ...`: the same as the `accel-gradsync` console script."""

from .cli import main

raise SystemExit(main())
