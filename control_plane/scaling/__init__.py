"""Scaling: the autoscaler's rule and its control loop, the simulator, and the actuators.

``policy`` is the pure target-tracking rule (``TargetTracking.decide``); ``loop`` the control loop
that reads signals, asks the policy and calls an actuator every tick (``Autoscaler``, built by
control_plane/app.py with ``--autoscale``); ``simulate`` replays a load trace through the same rule
and ``simulate_plot`` draws it (``switchboard autoscale simulate``, in ``cli``); ``actuators/`` hold
the local, Nomad and Kubernetes ways of changing the shard count.
"""
