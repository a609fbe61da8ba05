"""The expert store (store.py): one call per MoE layer, answered from RAM or fetched through the
tiers (tiers/, tier_chain.py) by fetch workers (fetch_queue.py), one record per expert in flight
(flights.py), prefetch (prefetch.py) and idle-link fill (fill.py), every copy checked
(integrity.py) and every use counted (stats.py)."""
