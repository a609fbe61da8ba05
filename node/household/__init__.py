"""The Macs of a household: finding them (discovery.py, lookup.py), who owns which expert
(membership.py), their experts as a tier of the store (peers_tier.py), filling an idle household
(warm.py), and running experts where they are (remote_experts.py asks, expert_compute.py serves)."""
