"""Other frameworks' import paths on trainrun: ``trainrun.compat.mmengine`` runs MMEngine users'
scripts with only their import lines changed."""
