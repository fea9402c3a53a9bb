"""The run wing: ``flowrl run``'s outer loop (:class:`~flowrl.run.trainer.Trainer`) and
``flowrl replay``, wiring every other wing together.

The wings that attach hooks to every worker task (:mod:`flowrl.runtime.hooks`) are found through
the ``flowrl.hooks`` entry points, so every run, and a ``Runtime`` used on its own, gets the same
hooks: fingerprints, and the failure policies with the fault switch.
"""
