"""Planning: the units a wrapper has (`units`), every count, byte and dtype formula (`costs`), the
sync policies that turn units into a frozen `Plan` (`policies`), free memory (`memory`) and auto's
re-planning (`replan`). Pure: no hooks, no flags; imports `config` only."""
