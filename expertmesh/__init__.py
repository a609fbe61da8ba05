"""expertmesh: trillion-parameter Mixture-of-Experts models on the Macs of a household.

expertmesh.cli          the `expertmesh` command: one module per command group
expertmesh.node         a node: engine -> store -> tiers, the Hub, the household, gRPC
expertmesh.coordinator  the OpenAI-compatible front door and `status`
expertmesh.v1           the gRPC contract, generated from proto/expertmesh/v1/node.proto
"""
