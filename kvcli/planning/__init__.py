"""Planning: between the policy registry and the drivers.

`formats` holds the two data formats both engines share (an `Observation`: what a policy observes;
a `Plan`: what it keeps); `planner` resolves a policy for a model and runs one engine's planner on an
observation. Nothing is imported here, so that the engines can import `formats` without the planner.
"""
