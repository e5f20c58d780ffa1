"""Ranks that run different numbers of micro-batches: `join` (`grad_sync.join()`, with its poll
`join_poll`, the loop's forwards `join_watch`, their record and replay `join_record`, the
optimizer steps it reports `join_steps`), `uneven` (uneven counts without `join()` refused) and
`uneven_steps` (`grad_sync.step(n)`: per-rank counts every step, with a short rank's last
micro-batch replayed by `step_replay`). Imports the rooms above but `integration`."""
