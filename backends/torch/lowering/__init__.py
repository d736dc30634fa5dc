"""Lower one rank's recorded aten ops onto operators of the rule table."""
