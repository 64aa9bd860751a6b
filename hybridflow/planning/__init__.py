"""Placement planning (docs/placement.md): the run's plan as one object (`plan.py`), the rules a
plan must pass (`rules.py`), the mapping search (`search.py`), the cost model (`cost.py`) with its
device profiles (`profiles.py`) and calibration (`calibrate.py`), `placement=auto` (`auto.py`) and
the `hybridflow plan` command (`cli.py`). Nothing here starts Ray or loads a model, except
calibration, which runs the `hybridflow` command."""
