from zmrl.verl.config import DIR

print(DIR)
