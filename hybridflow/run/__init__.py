"""The run: the stage decided before anything starts (`stage`, a pipeline's stages in `pipeline_stages`),
the cluster it runs on and the faults planted on purpose (`cluster`, `faults`), its start and end
(`launch`, `lifecycle`) and the pieces around a recipe's step loop (`runner`)."""
