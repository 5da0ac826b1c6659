"""Striped loads: a load at several ranks reads each byte of its target
once (`_plan`: the coordinator's plan of stripes; `_proofs`: what a rank
handed bytes checks them with; `_run`: the phases every rank runs). Its
users import the module that defines a name; nothing is re-exported."""
