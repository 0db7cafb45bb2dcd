"""Draft head kinds, each one module behind one interface (`heads.DraftHeads`; docs/design.md, "A kind"):

    heads        the interface, the registry, the saved spec, save and load
    attention    masked training attention that keeps no scores off a CPU (eagle3's and dflash's)
    blocks       what chained and parallel share: residual blocks, the context encoder, the target's LM head
    speculators  what eagle3 and dflash share: reading the target's layers, an LM head of their own, speculators' format
    chained      each head reads the previous one's state and the token before its own guess (the default)
    parallel     Medusa-1: every head reads h_t alone
    eagle3       EAGLE-3's draft layer, applied step after step
    dflash       DFlash's block drafter: one forward drafts every depth
    dspark       DSpark: dflash's block plus a Markov head over the drafted tokens and a confidence head

The registry is the list below: importing a kind's module registers it under its name.
"""

# the kinds, in the order they are listed to users: one line a kind
from . import chained  # noqa: F401, I001
from . import parallel  # noqa: F401
from . import eagle3  # noqa: F401
from . import dflash  # noqa: F401
from . import dspark  # noqa: F401
from .heads import KINDS, DraftHeads, HeadsSpec, kind_class, load_spec

__all__ = ["KINDS", "DraftHeads", "HeadsSpec", "kind_class", "load_spec"]
