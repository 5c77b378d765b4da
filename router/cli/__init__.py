"""The router's commands: ``kvroute router``, ``up``, ``generate``/``explain``, ``status``
and ``loadtest``. Argument parsing and process set-up; the work is done by
:mod:`router.service` and :mod:`router.core.router_core`."""
