"""Signals: what the autoscaler and the degradation controller decide on, read from either source.

``model`` holds the reading itself (:class:`Signals`, :class:`ShardSignal`, the ``SignalSource``
protocol, exposition parsing and ``histogram_quantile``); ``scrape`` the embedded reader that
scrapes every member's ``/metrics``; ``prometheus`` the reader over PromQL (``--prometheus URL``);
``source`` picks one at start-up (``build_signal_source``, called by control_plane/app.py).
"""
