"""The control plane: the process (``app``, ``settings``), the ``switchboard`` CLI (``cli``) and dev
launcher (``launcher``, ``supervisor``), the degradation ladder, zones, the policy store and state API,
and the ``registry/``, ``signals/``, ``scaling/`` and ``admin/`` packages; of the data plane it imports
only common, membership, protocol, tiers, the model store and the ledger store.
"""
