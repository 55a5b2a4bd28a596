"""What a merge is: the request, the operators, the plan; pure Python shared by the planner and the engine."""
