"""The accumulation window, the hot path per micro-batch: `window` (`Window`: hold the plan's
units through `no_sync`, count, abort), `kept_forward` (the last micro-batch's windowed params
kept through its forwards) and `window_checks` (what it tells the user about how `no_sync` was
used). Imports `wrappers`, `core`, `generating`."""
