"""The Macs of a household: finding them (discovery.py), who owns which expert (membership.py),
filling an idle household (warm.py), and running experts where they are (remote_experts.py)."""
