"""The warning category every accel_gradsync warning uses, so users can filter them at once."""


class GradSyncWarning(UserWarning):
    """A setting accel_gradsync ignores or cannot apply (each is emitted once)."""
