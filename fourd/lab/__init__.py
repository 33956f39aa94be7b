"""The lab: a local web page over fourd's schedules, simulator, layouts and planner (`fourd
lab`)."""
