"""Models and datasets as assets (`assets`), prompts and head evaluation (`evaluate`: τ, calibration) and the
side-by-side benchmark (`bench`). Tooling on top of the engine, heads and training; nothing below imports it."""
