"""The fleet supervisor: one daemon, in wings whose imports run one way (downwards).

    daemon, __main__                      wires the wings together; the entry point
    api/, dashboard/                      REST, Prometheus, the web dashboard
    sweeps/                               hyperparameter sweeps: the one Optuna client
    control/                              the job controller, orders, reconciliation
    recovery/                             failures in: the pure planner, the executor, incidents
    actuator                              what control and recovery both act through
    checkpoints/                          the catalog of committed steps, its publisher
    fleet/                                registry, burn-in, commands, MTBF
    telemetry/, auth/, scheduler/         training metrics; tokens and roles; the pure scheduler
    jobs, records, store, config, errors  the job record and its typed records, the SQLite
                                          store, settings, errors

A module imports only from its own wing or from a line below it
(``tests/unit/supervisor/test_imports.py`` holds every import to this). docs/architecture.md
walks a job and a failure through them.
"""
