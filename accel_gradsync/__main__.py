"""`python -m accel_gradsync estimate ...`: the same as the `accel-gradsync` console script."""

from accel_gradsync.estimator.cli import main

raise SystemExit(main())
