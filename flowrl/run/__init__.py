"""The run wing: ``flowrl run``'s outer loop (:class:`~flowrl.run.trainer.Trainer`) and
``flowrl replay``, wiring every other wing together.

The wings that attach hooks to every worker task (:mod:`flowrl.runtime.hooks`) register them
when imported; importing them here gives every run (and anything that imports this wing) the
same hooks: fingerprints, and the failure policies with the fault switch.
"""

from flowrl.provenance import fingerprints as _fingerprints  # noqa: F401 - registers its task hooks
from flowrl.recovery import faults as _faults  # noqa: F401 - registers its task hooks
