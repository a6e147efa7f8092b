"""The fault-injection rig: a fleet of hosts made of network namespaces on one machine (or
real machines over SSH), a tinylm job across them, and one fault per scenario.

``python -m tests.rig up|down|run|soak`` (see ``__main__.py``); ``pytest -m rig`` runs each
scenario once. docs/rig.md has the scenarios, what each expects, and the figures.
"""
