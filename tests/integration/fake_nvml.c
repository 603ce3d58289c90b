/*
 * A fake NVML: a test double for libnvidia-ml.so.1 on machines without an NVIDIA driver.
 * NOT NVIDIA's library and no part of gpushare; tests/integration/nvml.rs compiles it
 * (`cc -shared -fPIC`) into a test's temp dir and runs gpushare's binaries with
 * LD_LIBRARY_PATH naming that dir, so that `inventory = "nvml"` runs end to end.
 *
 * It implements exactly the entry points that src/device/nvml.rs reaches through
 * nvml-wrapper 0.13 for GPUs without MIG: nvml-wrapper resolves every symbol when it loads
 * the library and fails only when a missing one is called, so anything else (the MIG
 * device calls, nvmlErrorString, which the wrapper never calls) is left out on purpose.
 * Signatures and return codes as in nvml.h (nvml-wrapper-sys 0.10's bindings).
 *
 * What it reports: driver 550.54.15 and two GPUs, both an "NVIDIA A30" with 24 GiB,
 * compute capability 8.0, compute mode DEFAULT, MIG disabled, minors 0 and 1, with the
 * UUIDs FAKE_GPU0 and FAKE_GPU1 in tests/integration/nvml.rs, or those FAKE_NVML_GPUS
 * names (up to 4, comma-separated: a test of its own GPUs sees no other test's
 * processes). With FAKE_NVML_FAIL_INIT=1 in the environment nvmlInit_v2 fails with
 * NVML_ERROR_DRIVER_NOT_LOADED.
 *
 * Its processes (nvmlDeviceGetComputeRunningProcesses_v3 and
 * nvmlDeviceGetMPSComputeRunningProcesses_v3) are the simulator's: a simulated CUDA
 * process (an MPS server, an MPS client, a process that uses the GPU directly) holds a
 * memfd named "gpushare-fake-nvml" whose text is `<GPU UUID> <compute|mps> <bytes>`, as a
 * real one holds the driver's device files. The fake finds them the way the driver knows
 * them: in /proc/<pid>/fd of every process, so PIDs are the caller's (the host's) and a
 * process is listed exactly as long as it lives. `compute` processes are in the compute
 * list only, `mps` ones (MPS clients) in both, as NVML lists them (docs/mps.md).
 * With FAKE_NVML_FAIL_LIST=<GPU UUID> in the environment, listing that GPU's processes (both
 * lists) fails with NVML_ERROR_GPU_IS_LOST, as a GPU that fell off the bus does, while
 * every other call about it and every other GPU answers.
 * With FAKE_NVML_TABLE=<file> the processes are that file's lines instead, `<pid> <GPU
 * UUID> <compute|mps> <bytes>`, whether the PIDs live or not: scripts/bench lists a
 * thousand containers' processes that way, so that what it measures is the watcher and
 * not this fake's walk through /proc.
 *
 * Like NVIDIA's library, nvmlInit_v2 leaves a thread of its own running in the process,
 * also after nvmlShutdown and the wrapper's dlclose (nvml.rs links the library with
 * `-z nodelete`, so that the thread's code stays mapped): a process that has loaded NVML
 * is multithreaded, and, for one, setns(2) then refuses it a mount namespace (EINVAL).
 */
#include <ctype.h>
#include <dirent.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

typedef int nvmlReturn_t;
enum {
    NVML_SUCCESS = 0,
    NVML_ERROR_UNINITIALIZED = 1,
    NVML_ERROR_INVALID_ARGUMENT = 2,
    NVML_ERROR_INSUFFICIENT_SIZE = 7,
    NVML_ERROR_DRIVER_NOT_LOADED = 9,
    NVML_ERROR_GPU_IS_LOST = 15,
};
enum { NVML_COMPUTEMODE_DEFAULT = 0 };
enum { NVML_DEVICE_MIG_DISABLE = 0 };

/* nvmlMemory_v2_t; nvml-wrapper calls nvmlDeviceGetMemoryInfo_v2 with it. */
typedef struct {
    unsigned int version;
    unsigned long long total;
    unsigned long long reserved;
    unsigned long long free;
    unsigned long long used;
} nvmlMemory_v2_t;

struct fake_gpu {
    char uuid[96];
    const char *name;
    unsigned int minor;
};

/* nvmlDevice_t is an opaque pointer: here, a pointer into this table. */
typedef const struct fake_gpu *nvmlDevice_t;

#define MAX_GPUS 4
static struct fake_gpu gpus[MAX_GPUS];
static unsigned int gpu_count;
static const unsigned long long memory_bytes = 24ULL << 30;
static int initialised;

/* nvmlProcessInfo_v2_t, which the _v3 process calls fill. */
typedef struct {
    unsigned int pid;
    unsigned long long usedGpuMemory;
    unsigned int gpuInstanceId;
    unsigned int computeInstanceId;
} nvmlProcessInfo_t;

/* The GPUs: FAKE_NVML_GPUS, else the two default UUIDs. */
static void load_gpus(void) {
    const char *list = getenv("FAKE_NVML_GPUS");
    if (list == NULL || *list == '\0')
        list = "GPU-0fa4e000-0000-4000-8000-00000000a300,GPU-0fa4e000-0000-4000-8000-00000000a301";
    gpu_count = 0;
    while (*list != '\0' && gpu_count < MAX_GPUS) {
        size_t n = strcspn(list, ",");
        if (n > 0 && n < sizeof(gpus[0].uuid)) {
            memcpy(gpus[gpu_count].uuid, list, n);
            gpus[gpu_count].uuid[n] = '\0';
            gpus[gpu_count].name = "NVIDIA A30";
            gpus[gpu_count].minor = gpu_count;
            gpu_count++;
        }
        list += n;
        if (*list == ',')
            list++;
    }
}

static int known(nvmlDevice_t device) {
    return device >= gpus && device < gpus + gpu_count;
}

/* Copies `s` into `buf` of `size` bytes, NUL included, as NVML's string getters do. */
static nvmlReturn_t copy_string(const char *s, char *buf, unsigned int size) {
    if (buf == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (strlen(s) + 1 > size)
        return NVML_ERROR_INSUFFICIENT_SIZE;
    strcpy(buf, s);
    return NVML_SUCCESS;
}

/* The checks every device getter starts with. */
#define DEVICE_CALL(device, out)                 \
    do {                                         \
        if (!initialised)                        \
            return NVML_ERROR_UNINITIALIZED;     \
        if (!known(device) || (out) == NULL)     \
            return NVML_ERROR_INVALID_ARGUMENT;  \
    } while (0)

static void *idle(void *arg) {
    (void)arg;
    for (;;)
        pause();
    return NULL;
}

nvmlReturn_t nvmlInit_v2(void) {
    const char *fail = getenv("FAKE_NVML_FAIL_INIT");
    if (fail != NULL && strcmp(fail, "1") == 0)
        return NVML_ERROR_DRIVER_NOT_LOADED;
    if (!initialised) {
        pthread_t t;
        load_gpus();
        if (pthread_create(&t, NULL, idle, NULL) == 0)
            pthread_detach(t);
    }
    initialised = 1;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlShutdown(void) {
    if (!initialised)
        return NVML_ERROR_UNINITIALIZED;
    initialised = 0;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length) {
    if (!initialised)
        return NVML_ERROR_UNINITIALIZED;
    /* FAKE_NVML_DRIVER_VERSION: another driver (a branch with MPS v3, 615 and later). */
    const char *driver = getenv("FAKE_NVML_DRIVER_VERSION");
    return copy_string(driver && *driver ? driver : "550.54.15", version, length);
}

nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *count) {
    if (!initialised)
        return NVML_ERROR_UNINITIALIZED;
    if (count == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    *count = gpu_count;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device) {
    if (!initialised)
        return NVML_ERROR_UNINITIALIZED;
    if (index >= gpu_count || device == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    *device = &gpus[index];
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t device, char *uuid, unsigned int length) {
    DEVICE_CALL(device, uuid);
    return copy_string(device->uuid, uuid, length);
}

nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t device, char *name, unsigned int length) {
    DEVICE_CALL(device, name);
    return copy_string(device->name, name, length);
}

nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t device, nvmlMemory_v2_t *memory) {
    DEVICE_CALL(device, memory);
    memory->total = memory_bytes;
    memory->reserved = 0;
    memory->used = 0;
    memory->free = memory_bytes;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetComputeMode(nvmlDevice_t device, int *mode) {
    DEVICE_CALL(device, mode);
    *mode = NVML_COMPUTEMODE_DEFAULT;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetMinorNumber(nvmlDevice_t device, unsigned int *minor) {
    DEVICE_CALL(device, minor);
    *minor = device->minor;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetCudaComputeCapability(nvmlDevice_t device, int *major, int *minor) {
    DEVICE_CALL(device, major);
    if (minor == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    *major = 8;
    *minor = 0;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetMigMode(nvmlDevice_t device, unsigned int *current,
                                  unsigned int *pending) {
    DEVICE_CALL(device, current);
    if (pending == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    *current = NVML_DEVICE_MIG_DISABLE;
    *pending = NVML_DEVICE_MIG_DISABLE;
    return NVML_SUCCESS;
}

/* The name of the memfd a simulated CUDA process holds (sim/src/gpu.rs). */
static const char CONTEXT_LINK[] = "/memfd:gpushare-fake-nvml";

/*
 * The processes on `device`, `mps_only` for the MPS list: every context memfd held by a
 * live process, read through /proc/<pid>/fd/<n>. Fills at most `room` entries and
 * returns how many there are.
 */
static unsigned int from_table(const char *table, nvmlDevice_t device, int mps_only,
                               nvmlProcessInfo_t *out, unsigned int room) {
    unsigned int found = 0;
    FILE *f = fopen(table, "re");
    if (f == NULL)
        return 0;
    char line[256];
    while (fgets(line, sizeof line, f) != NULL) {
        unsigned int pid;
        char uuid[96], kind[16];
        unsigned long long bytes;
        if (sscanf(line, "%u %95s %15s %llu", &pid, uuid, kind, &bytes) != 4)
            continue;
        if (strcmp(uuid, device->uuid) != 0 || (mps_only && strcmp(kind, "mps") != 0))
            continue;
        if (found < room) {
            out[found].pid = pid;
            out[found].usedGpuMemory = bytes;
            out[found].gpuInstanceId = 0xFFFFFFFF;
            out[found].computeInstanceId = 0xFFFFFFFF;
        }
        found++;
    }
    fclose(f);
    return found;
}

static unsigned int scan(nvmlDevice_t device, int mps_only, nvmlProcessInfo_t *out,
                         unsigned int room) {
    const char *table = getenv("FAKE_NVML_TABLE");
    if (table != NULL && *table != '\0')
        return from_table(table, device, mps_only, out, room);
    unsigned int found = 0;
    DIR *proc = opendir("/proc");
    if (proc == NULL)
        return 0;
    struct dirent *p;
    while ((p = readdir(proc)) != NULL) {
        if (!isdigit((unsigned char)p->d_name[0]))
            continue;
        char dir[300];
        snprintf(dir, sizeof dir, "/proc/%.32s/fd", p->d_name);
        DIR *fds = opendir(dir);
        if (fds == NULL)
            continue;
        unsigned long long used = 0;
        int listed = 0;
        struct dirent *f;
        while ((f = readdir(fds)) != NULL) {
            char path[400], link[256];
            snprintf(path, sizeof path, "%.300s/%.32s", dir, f->d_name);
            ssize_t n = readlink(path, link, sizeof link - 1);
            if (n <= 0)
                continue;
            link[n] = '\0';
            if (strncmp(link, CONTEXT_LINK, sizeof CONTEXT_LINK - 1) != 0)
                continue;
            int fd = open(path, O_RDONLY | O_CLOEXEC);
            if (fd < 0)
                continue;
            char text[256] = {0};
            ssize_t got = pread(fd, text, sizeof text - 1, 0);
            close(fd);
            if (got <= 0)
                continue;
            char uuid[96], kind[16];
            unsigned long long bytes;
            if (sscanf(text, "%95s %15s %llu", uuid, kind, &bytes) != 3)
                continue;
            if (strcmp(uuid, device->uuid) != 0)
                continue;
            int mps = strcmp(kind, "mps") == 0;
            if (mps_only && !mps)
                continue;
            used += bytes;
            listed = 1;
        }
        closedir(fds);
        if (listed) {
            if (found < room) {
                out[found].pid = (unsigned int)strtoul(p->d_name, NULL, 10);
                out[found].usedGpuMemory = used;
                out[found].gpuInstanceId = 0xFFFFFFFF;
                out[found].computeInstanceId = 0xFFFFFFFF;
            }
            found++;
        }
    }
    closedir(proc);
    return found;
}

/* NVML's contract: with too small a buffer (or none), the count needed and
 * NVML_ERROR_INSUFFICIENT_SIZE; a process may come or go between the two calls. */
static nvmlReturn_t processes(nvmlDevice_t device, unsigned int *count,
                              nvmlProcessInfo_t *infos, int mps_only) {
    DEVICE_CALL(device, count);
    const char *lost = getenv("FAKE_NVML_FAIL_LIST");
    if (lost != NULL && strcmp(lost, device->uuid) == 0)
        return NVML_ERROR_GPU_IS_LOST;
    unsigned int room = infos == NULL ? 0 : *count;
    unsigned int found = scan(device, mps_only, infos, room);
    *count = found;
    if (found > room)
        return NVML_ERROR_INSUFFICIENT_SIZE;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t device, unsigned int *count,
                                                     nvmlProcessInfo_t *infos) {
    return processes(device, count, infos, 0);
}

nvmlReturn_t nvmlDeviceGetMPSComputeRunningProcesses_v3(nvmlDevice_t device,
                                                        unsigned int *count,
                                                        nvmlProcessInfo_t *infos) {
    return processes(device, count, infos, 1);
}
