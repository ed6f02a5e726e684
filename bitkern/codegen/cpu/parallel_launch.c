/* The parallel launch of bitkern's CPU kernels: a kernel's tasks run on torch's own OpenMP team.

   TVM-compiled kernels hand their parallel loops to the function behind `__TVMBackendParallelLaunch`
   (a context symbol set when a kernel library is loaded).  TVM's own thread pool and the OpenMP team
   torch's ops run on are two sets of spinning threads; on a machine with few cores they take the cores
   from each other.  `bitkern_parallel_launch` runs the tasks through GOMP_parallel of the OpenMP runtime
   that libtorch_cpu uses, sized by at::get_num_threads(), exactly as torch's own at::parallel_for does:
   one pool of workers for both.  Everything is resolved from the already-loaded libtorch_cpu at bind time,
   so this library links nothing but libc and libdl and does not depend on the Python version. */

#include <dlfcn.h>
#include <stdint.h>

typedef struct {
  void* sync_handle;
  int32_t num_task;
} TVMParallelGroupEnv;

typedef int (*TVMParallelLambda)(int task_id, TVMParallelGroupEnv* env, void* data);

static void (*gomp_parallel)(void (*body)(void*), void* data, unsigned threads, unsigned flags);
static void (*gomp_barrier)(void);
static int (*omp_get_thread_num_fn)(void);
static int (*omp_get_num_threads_fn)(void);
static int (*torch_num_threads)(void);

typedef struct {
  TVMParallelLambda lambda;
  void* data;
  int num_task; /* 0: one task per thread of the team */
  int failed;
} Launch;

static void run_tasks(Launch* launch, int thread, int team) {
  TVMParallelGroupEnv env = {0, launch->num_task ? launch->num_task : team};
  for (int task = thread; task < env.num_task; task += team) {
    if (launch->lambda(task, &env, launch->data) != 0) {
      __atomic_store_n(&launch->failed, 1, __ATOMIC_RELAXED);
    }
  }
}

static void team_body(void* data) {
  run_tasks((Launch*)data, omp_get_thread_num_fn(), omp_get_num_threads_fn());
}

/* TVMBackendParallelLaunch's contract: run lambda(task, env, data) for every task of the group, with
   env->num_task the group's size (num_task, or the team's size when num_task is 0); 0 on success. */
int bitkern_parallel_launch(TVMParallelLambda lambda, void* data, int num_task) {
  Launch launch = {lambda, data, num_task, 0};
  int threads = torch_num_threads();
  if (num_task > 0 && num_task < threads) threads = num_task;
  if (threads <= 1) {
    run_tasks(&launch, 0, 1);
  } else {
    gomp_parallel(team_body, &launch, (unsigned)threads, 0);
  }
  return launch.failed ? -1 : 0;
}

/* TVMBackendParallelBarrier's contract for groups launched above: every task of the team waits here. */
int bitkern_parallel_barrier(int task_id, TVMParallelGroupEnv* env) {
  (void)task_id;
  (void)env;
  gomp_barrier();
  return 0;
}

/* Resolve the OpenMP runtime and thread count of the loaded libtorch_cpu at `torch_cpu_path` (dlsym on
   its handle searches it and its dependencies: the libgomp torch ships).  Returns 0, or the 1-based index
   of the first symbol that is missing (-1: the library is not loaded). */
int bitkern_parallel_bind(const char* torch_cpu_path) {
  void* torch = dlopen(torch_cpu_path, RTLD_NOW | RTLD_NOLOAD);
  if (!torch) return -1;
  void** slots[] = {(void**)&gomp_parallel, (void**)&gomp_barrier, (void**)&omp_get_thread_num_fn,
                    (void**)&omp_get_num_threads_fn, (void**)&torch_num_threads};
  const char* names[] = {"GOMP_parallel", "GOMP_barrier", "omp_get_thread_num", "omp_get_num_threads",
                         "_ZN2at15get_num_threadsEv"};
  for (int i = 0; i < 5; ++i) {
    *slots[i] = dlsym(torch, names[i]);
    if (!*slots[i]) return i + 1;
  }
  return 0;
}
