"""The life of a run across attempts: how an attempt ends, whether the job comes back, cancel."""
