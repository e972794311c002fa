# One pipeline group whose stages run on different nodes (a model larger than one node; docs/SHARDING.md).
#
#   nomad job run -var image=registry.example.com/switchboard:0.1.0 deploy/nomad/switchboard-pipeline.nomad.hcl
#
# Run it beside switchboard.nomad.hcl (control plane, gateways, cache nodes, autoscaled shards): its
# stage 0 registers as one more `switchboard-shard` in Consul.
#
# Its tasks read the cluster token from the `switchboard` job's variable (nomad/jobs/switchboard,
# cluster_token; and metrics_token when it is there; see switchboard.nomad.hcl). A job reads only
# its own nomad/jobs/<job> path by default, so with ACLs on give this job (and each switchboard-pp-<i>
# the autoscaler registers) a policy that reads it:
#
#   nomad acl policy apply -namespace default -job switchboard-pp-a switchboard-cluster-token policy.hcl
#   # policy.hcl: namespace "default" { variables { path "nomad/jobs/switchboard" { capabilities = ["read"] } } }
#
# Without the token stage 0 refuses the stage (both log it) and the group never serves.
#
# A job per pipeline group, a task group per stage, and `distinct_hosts` on the job: no two stages
# on one client. Why not one task group per pipeline: Nomad places a task group as a unit, all its
# tasks on one client, so a group per pipeline is the one-node placement (switchboard.nomad.hcl's
# `shard` group with shard_pipeline_parallel_size = N: stage 0 starts the other stages as its
# children). Across nodes each stage must be a group of its own.
#
#   stage0  the shard: HTTP, membership (Nomad registers it in Consul), the scheduler, the embedding,
#           its layers and the head. It starts no stage (--pipeline-remote-stages) but publishes each
#           stage's arguments in its TCPStore on the `pipeline` port and waits for them; that port
#           is registered in Consul as switchboard-pp-a-store.
#   stage1  `switchboard stage --join` at that address (rendered from Consul by the template; a new
#           address restarts the task), loads only its layers and joins stage 0's gloo group.
#
# For N stages add groups stage2 .. stageN-1 like stage1 (--rank i) and set --pipeline-parallel-size
# N and --pipeline-remote-stages 1,...,N-1. Losing a stage: stage 0 detects it in ~1 s, fails its open
# streams (the gateways resume them on other shards), leaves Consul and exits 1, and Nomad restarts
# it; the other stages exit when their heartbeat to stage 0 has not gone through for 5 s and are
# restarted to join again.
#
# Scaled by the autoscaler, a replica a group: give the control plane this file as its template
# (`--actuator nomad --pipeline-group-template /local/switchboard-pipeline.nomad.hcl`, the file in its
# task through an `artifact` or `template` block). It has Nomad parse it once (POST /v1/jobs/parse,
# no variables given: set the defaults below, e.g. `image`, or give it instead the JSON that
# `nomad job run -output -var image=... switchboard-pipeline.nomad.hcl` prints) and registers one
# copy a group, jobs switchboard-pp-0, switchboard-pp-1, ... with every `switchboard-pp-a` renamed (the
# job, the store service and the template that reads it) and meta switchboard_managed_by; scaling
# in deregisters the highest ids first (control_plane/scaling/actuators/nomad_groups.py). Its token
# then needs list-jobs, read-job, parse-job and submit-job on the namespace. Run by hand (above), this
# job is one fixed group beside those; the autoscaler neither counts nor stops it.

variable "image" {
  type    = string
  default = "switchboard:0.1.0"
}

variable "datacenters" {
  type    = list(string)
  default = ["dc1"]
}

variable "threads_per_stage" {
  type    = number
  default = 4
}

job "switchboard-pp-a" {
  datacenters = var.datacenters
  type        = "service"

  # one stage per client node
  constraint {
    operator = "distinct_hosts"
    value    = "true"
  }

  group "stage0" {
    count = 1

    network {
      port "http" {}
      port "pipeline" {}
    }

    service {
      name     = "switchboard-shard"
      port     = "http"
      provider = "consul"
      meta {
        url                    = "http://${NOMAD_ADDR_http}"
        engine                 = "torch"
        pipeline_parallel_size = "2"
        zone                   = "${node.datacenter}"
        keepalive_s            = "0.5"
      }
      check {
        type     = "http"
        path     = "/health" # 503 until the model is loaded and every stage joined
        interval = "2s"
        timeout  = "1s"
      }
    }

    # where the other stages join (no check: they must find it before it serves)
    service {
      name     = "switchboard-pp-a-store"
      port     = "pipeline"
      provider = "consul"
    }

    shutdown_delay = "5s"

    task "shard" {
      driver       = "docker"
      kill_signal  = "SIGTERM"
      kill_timeout = "60s"

      config {
        image        = var.image
        network_mode = "host"
        command      = "switchboard"
        args = [
          "shard",
          "--host", "${NOMAD_IP_http}",
          "--port", "${NOMAD_PORT_http}",
          "--engine", "torch",
          "--threads", "${var.threads_per_stage}",
          "--pipeline-parallel-size", "2",
          "--pipeline-remote-stages", "1",
          "--pipeline-host", "${NOMAD_IP_pipeline}",
          "--pipeline-port", "${NOMAD_PORT_pipeline}",
          "--pipeline-stage-timeout-s", "2",
          "--pipeline-exit-linger-s", "16",
          "--zone", "${node.datacenter}"
        ]
      }

      template {
        destination          = "secrets/cluster.env"
        env                  = true
        error_on_missing_key = true # no cluster_token in the variable: the task does not start (never a "<no value>" token)
        data        = <<-EOT
          {{ with nomadVar "nomad/jobs/switchboard" }}SWITCHBOARD_CLUSTER_TOKEN={{ .cluster_token }}{{ end }}
          {{ with nomadVar "nomad/jobs/switchboard" }}{{ range $k, $v := . }}{{ if eq $k "metrics_token" }}SWITCHBOARD_METRICS_TOKEN={{ $v }}{{ end }}{{ end }}{{ end }}
        EOT
      }

      resources {
        # one stage: its threads, and weights/N + KV/N + a fixed ~0.3 GiB a process (SHARDING.md)
        cpu    = 1000 * var.threads_per_stage
        memory = 1536
      }
    }
  }

  group "stage1" {
    count = 1

    task "stage" {
      driver = "docker"

      config {
        image        = var.image
        network_mode = "host"
        command      = "switchboard"
        args = [
          "stage",
          "--join", "${JOIN}",
          "--rank", "1",
          "--bind", "${attr.unique.network.ip-address}"
        ]
      }

      template {
        data        = <<-EOT
          JOIN={{ range service "switchboard-pp-a-store" }}{{ .Address }}:{{ .Port }}{{ end }}
        EOT
        destination = "local/join.env"
        env         = true
        change_mode = "restart"
      }

      template {
        destination          = "secrets/cluster.env"
        env                  = true
        error_on_missing_key = true # no cluster_token in the variable: the task does not start (never a "<no value>" token)
        data        = <<-EOT
          {{ with nomadVar "nomad/jobs/switchboard" }}SWITCHBOARD_CLUSTER_TOKEN={{ .cluster_token }}{{ end }}
          {{ with nomadVar "nomad/jobs/switchboard" }}{{ range $k, $v := . }}{{ if eq $k "metrics_token" }}SWITCHBOARD_METRICS_TOKEN={{ $v }}{{ end }}{{ end }}{{ end }}
        EOT
      }

      resources {
        cpu    = 1000 * var.threads_per_stage
        memory = 1024
      }
    }
  }
}
