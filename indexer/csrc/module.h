/* Argument helpers shared by module.c (the type) and methods.c (its methods). */
#ifndef KVROUTE_MODULE_H
#define KVROUTE_MODULE_H

#include "core.h"

u64 *u64_array(PyObject *seq, Py_ssize_t *n);
int check_wid(Core *c, int wid);
int tier_id(Core *c, PyObject *name, int create);
void free_worker(Worker *w);
extern PyMethodDef Core_methods[];

#endif
