"""Routing planner: static M-to-N routing tables, the makespan model and its baselines (pure code)."""

from .catalog import Catalog
from .links import LinkClass, LinkModel, Participant, link_class
from .mapping import MAPPINGS, Mapping, Rule, get_mapping
from .model import broadcast_assignment, lower_bound, makespan, seed_greedy_assignment
from .needs import Piece, PlanCache, build_pieces
from .planner import PlanOptions, plan
from .tables import RoutingPlan, tables_from_assignment

__all__ = [
    "Catalog", "LinkClass", "LinkModel", "Participant", "link_class", "broadcast_assignment", "lower_bound", "makespan",
    "seed_greedy_assignment", "Piece", "PlanCache", "build_pieces", "PlanOptions", "RoutingPlan", "plan",
    "tables_from_assignment", "MAPPINGS", "Mapping", "Rule", "get_mapping",
]
