"""Let the test run pay torch's composite-op materialization once per change of the
dispatcher, not once per op namespace.

Every ``ExportedProgram.run_decompositions()`` collects the composite-implicit (CIA)
ops twice, and each collection calls ``torch._export.utils._materialize_cpp_cia_ops``
once per op namespace (33 in the test run): it reads every CIA registration of the C++
dispatcher and looks each one up in ``torch.ops``. The look-ups only create the
``torch.ops`` objects; once made they stay until their op is deregistered, and
deregistering an op with a CIA kernel changes the registration list. So while the list
is the one last materialized, materializing again changes nothing.

``materialize_only_on_change`` wraps the function to skip exactly that repeat, and the
decomposed programs are the same. In the test run it took the two collections of a call
from about 0.11 to 0.04 s (of 0.25-0.55 s a call). ``tests/test_cia_materialization.py``
checks that an op registered afterwards is still collected. With a torch that lacks the
private function the test run goes unchanged.
"""

import functools

import torch
import torch._export.utils as export_utils

_CIA_KEY = "CompositeImplicitAutograd"


def materialize_only_on_change() -> None:
    """Wrap ``_materialize_cpp_cia_ops`` (once per process) to return at once while the
    dispatcher's CIA registrations are those it last materialized."""
    materialize = getattr(export_utils, "_materialize_cpp_cia_ops", None)
    if materialize is None or hasattr(materialize, "materialized_registrations"):
        return

    @functools.wraps(materialize)
    def materialize_on_change() -> None:
        registrations = torch._C._dispatch_get_registrations_for_dispatch_key(_CIA_KEY)
        if registrations != materialize_on_change.materialized_registrations:
            materialize()
            materialize_on_change.materialized_registrations = registrations

    materialize_on_change.materialized_registrations = None
    export_utils._materialize_cpp_cia_ops = materialize_on_change
