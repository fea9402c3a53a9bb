"""The run wing: ``flowrl run``'s outer loop (:class:`~flowrl.run.trainer.Trainer`) and
``flowrl replay``, wiring every other wing together.
"""
